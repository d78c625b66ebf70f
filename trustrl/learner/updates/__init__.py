"""Update steps: ``registry.py`` picks one by ``config.algo``; ``ppo.py``, ``trpo.py``; the
gradient backends (``grads.py``) and PPO's optional critic process (``critic_worker.py``)."""
