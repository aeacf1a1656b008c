"""The GDN kernel's instruments: the benchmark and tuner (bench.py), the Nsight Compute profile
(ncu_profile.py, ncu_profile.sh)."""
