"""``python -m bench``: see bench/run.py."""
import sys

from bench.run import main
from posjax.training.host_memory import keep_freed_memory

keep_freed_memory()   # both frameworks, before the first computation
sys.exit(main())
