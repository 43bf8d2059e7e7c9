"""Calling a model's builder without ever downloading: every weight argument the builder takes is
set to "none" unless the user gave it, and any network connection it still attempts becomes a
`DownloadError` naming the address. Pure Python (no torch), so it is tested without PyTorch.
"""

from __future__ import annotations

import contextlib
import inspect
import socket

# The builders' arguments that fetch pretrained weights, and the value that fetches nothing:
# torchvision's `weights` / `weights_backbone`, older torchvision's and timm's `pretrained` /
# `pretrained_backbone`, segmentation_models_pytorch's `encoder_weights`.
NO_DOWNLOAD = {
    "weights": None,
    "weights_backbone": None,
    "pretrained": False,
    "pretrained_backbone": False,
    "encoder_weights": None,
}


class DownloadError(Exception):
    """A builder tried to reach the network; `str()` says where and what to do instead."""


class _Refused(ConnectionRefusedError):
    """What a refused connection raises inside `no_downloads` (an `OSError`, as a network failure
    is, so libraries handle it as they handle being offline)."""


ADVICE = ("kiln-torch exports never download: build the model with random weights (weights=None, weights_backbone=None, "
          "pretrained=False, encoder_weights=None: --kwargs KEY=None) and load trained ones with --weights FILE.safetensors")


def no_download_kwargs(builder, kwargs: dict, module_name: str = "") -> dict:
    """`kwargs` with each of `NO_DOWNLOAD`'s arguments that `builder` takes (by name, or through
    `**kwargs` for torchvision's builders, whose `**kwargs` reach the model) and that the user did
    not give, set to its no-download value."""
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):  # a builtin or a C extension: nothing to read
        return dict(kwargs)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = dict(kwargs)
    for name, value in NO_DOWNLOAD.items():
        if name in out:
            continue
        if name in params or (name == "weights" and takes_any and module_name.startswith("torchvision.models")):
            out[name] = value
    return out


@contextlib.contextmanager
def no_downloads(what: str):
    """Refuses every outgoing network connection inside the block (torch.hub, urllib, requests and
    the Hugging Face hub all connect through `socket`); if the block then fails, whatever a
    library made of the refusal, the error is a `DownloadError` naming the address."""
    attempts = []
    real_connect, real_create = socket.socket.connect, socket.create_connection

    def refuse(address):
        attempts.append(address)
        raise _Refused(f"kiln-torch refused a connection to {address!r}")

    def connect(sock, address, *args, **kwargs):
        refuse(address)

    def create_connection(address, *args, **kwargs):
        refuse(address)

    socket.socket.connect = connect
    socket.create_connection = create_connection
    try:
        yield
    except Exception as e:
        if not attempts:
            raise
        cause = "" if isinstance(e, _Refused) else f" ({type(e).__name__}: {e})"
        raise DownloadError(f"{what} tried to download (a connection to {attempts[0]!r}){cause}; {ADVICE}") from e
    finally:
        socket.socket.connect, socket.create_connection = real_connect, real_create


def build(builder, kwargs: dict, module_name: str = "", what: str = "the model's builder"):
    """`builder(**kwargs)` with `no_download_kwargs` and under `no_downloads`."""
    with no_downloads(what):
        return builder(**no_download_kwargs(builder, kwargs, module_name))
