"""posjax benchmarks (``python -m bench --help``); results and commands live in BENCHMARKS.md.

torch and transformers are imported here only (never by ``posjax``).
"""
