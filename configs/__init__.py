"""Config files (ml_collections): one per recipe; ``text_recipes`` builds the text ones.

A package so that config files can share ``configs.text_recipes`` (the repository root is on
the path of train.py, eval.py and the tests)."""
