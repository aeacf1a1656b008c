"""HyMo's kernels, installed as the import package ``hymo_kernels``.

Each op folder holds a pure-PyTorch reference (``naive.py``) beside its fast implementation.
"""
