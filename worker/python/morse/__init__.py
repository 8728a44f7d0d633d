"""Morse: data-parallel training through a 1-bit Adam parameter server.

    import morse.torch
    optimizer = morse.torch.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)

Run the script with `morse-run --servers 2 --workers 4 -- python3 train.py`.
"""
from ._native import MorseError, cuda_device  # noqa: F401

__all__ = ["MorseError", "cuda_device"]
