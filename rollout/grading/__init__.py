"""Grading: everything that turns an answer into a reward, in the grading processes.

``pool.py`` (the process pool, ``VerifierPool``/``PooledVerifier``) and ``process.py`` (a grading
process's side: ``PoolGrader``, ``Graded``, ``worker_main``); the graders: ``math_grading.py``
(``MathVerify``), ``custom.py`` (a custom task's ``task.reward``: ``RewardFunction``) and
``graders.py`` (the built-in rewards, ``rollout.grading.graders:NAME``); what graders use:
``sandbox.py`` (the one seam model-written code runs through) and ``http_guard.py`` (what
``http_reward`` may reach). The tasks that grade here stay in ``rollout/`` (``math_task.py``,
``custom_task.py``). Imports nothing: a grading process loads only what it grades with.
"""
