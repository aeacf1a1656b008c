"""HyMo's kernels, installed as the import package ``hymo_kernels``.

Each op folder holds its pure-PyTorch reference (``gdn/naive.py``, ``ce/chunk_torch.py``,
``normuon/fused_torch.py``) beside its fast implementation; ``runtime.py`` says whether a Triton
kernel can run on a device.
"""
