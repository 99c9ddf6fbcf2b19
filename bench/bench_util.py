"""Helpers shared by the Python benchmark drivers and their PyTorch workers (bench/*.py)."""
import ctypes


def live_bytes(name):
    """bench/live_bytes.cpp's counter `name` when it is preloaded (LD_PRELOAD), else None."""
    fn = getattr(ctypes.CDLL(None), name, None)
    if fn is not None:
        fn.restype = ctypes.c_int64 if name != "live_bytes_reset_peak" else None
    return fn
