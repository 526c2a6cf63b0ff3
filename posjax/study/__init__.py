"""Position-encoding studies: a grid of training cells run as one resumable command, and a
report built from the cells' results files (``python -m posjax.study``, STUDY.md)."""
