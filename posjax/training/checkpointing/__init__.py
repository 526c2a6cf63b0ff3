"""Checkpointing, in one place: ``<workdir>/checkpoints/<step>/`` and what keeps it sound.

``checkpointer``  save and restore (``Checkpointer``: Orbax, asynchronous saves, preemption;
                  a step that cannot be restored is a ``DamagedStep``);
``integrity``     each step's record of its files, the check against it, ``move_aside`` for a
                  damaged step, and the listings ``saved_steps`` / ``intact_steps``;
``resume``        the newest intact step (``restore_newest_intact``), for a training run's
                  resume and for eval.py alike;
``lock``          one training run per workdir (``exclusive``, ``train.lock``).
"""
