"""How a model's forward runs in a decode loop: the reference or the fast forward (``runner.py``)."""
