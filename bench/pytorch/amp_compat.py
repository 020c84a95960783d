"""What the PyTorch peers need to run torch.amp the same way on every torch
they meet: a GradScaler for the device (older torch, such as Debian 12's
1.13, has only the CUDA one), and whether autocast really runs a dtype on
the device (older CPU autocast takes only bf16)."""

import warnings

import torch


def make_scaler(device: torch.device, enabled: bool):
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device.type, enabled=enabled)
    # Older torch has only the CUDA scaler; disabled, it is a pass-through
    # on any device.
    return torch.cuda.amp.GradScaler(enabled=enabled)


def autocast_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Older CPU autocast (torch 1.13) takes only bf16: for fp16 it raises or
    silently disables itself, which would time fp32 under an fp16 label."""
    if device.type != "cpu":
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autocast("cpu", dtype=dtype):
                return torch.is_autocast_cpu_enabled()
        except RuntimeError:  # newer 1.x raises where older ones warned
            return False
