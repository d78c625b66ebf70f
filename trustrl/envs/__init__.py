"""Environments as rows: the row contract (``rows``), the spaces as plain data
(``spaces``), and the adapters that present a Gymnasium vector env (``gym``) or a
PettingZoo parallel env (``pettingzoo``) through it. Imports no torch."""
