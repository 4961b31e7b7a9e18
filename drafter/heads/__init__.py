"""EAGLE draft heads: the shared head (base.py), one class per kind (eagle1.py,
eagle3.py), and loading from EAGLE checkpoints (checkpoint.py, load.py)."""
