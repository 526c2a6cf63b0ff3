"""``python -m bench``: see bench/run.py; ``python -m bench profile``: see bench/profile.py."""
import sys

from bench.host_memory import keep_freed_memory

keep_freed_memory()   # both frameworks, before the first computation
if sys.argv[1:2] == ["profile"]:
    from bench.profile import main as profile_main
    sys.exit(profile_main(sys.argv[2:]))
from bench.run import main  # noqa: E402

sys.exit(main())
