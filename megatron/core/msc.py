"""The Multi-Storage Client (``--enable-msc``): ``msc://PROFILE/PATH`` URLs for data and checkpoints.

The ``multi-storage-client`` package (PyPI, optional here as in Megatron-LM) resolves a URL's
profile through its YAML configuration (``MSC_CONFIG`` or ``~/.msc_config.yaml``) to a storage
service: a POSIX folder, S3, GCS, Azure, OCI, AIStore. This module is the one place that imports
it; the data reader (:mod:`megatron.data.object_storage`) and the checkpoint mirror
(:mod:`megatron.checkpoint.object_storage`) go through it.

Local paths never go through the client, enabled or not: for a POSIX path the client reads and
writes the same bytes the plain file calls do.
"""

from typing import Optional

MSC_PREFIX = "msc://"
INSTALL_HINT = "pip install multi-storage-client (add the extra of your storage service, e.g. " \
               "'multi-storage-client[boto3]' for S3)"


class ObjectStorageError(ValueError):
    """A bad ``msc://`` URL, a missing package or profile, or a failed transfer; names the URL."""


def is_msc_url(path: Optional[str]) -> bool:
    return isinstance(path, str) and path.startswith(MSC_PREFIX)


def client():
    """The ``multistorageclient`` module, or a one-line error saying how to install it."""
    try:
        import multistorageclient
    except ImportError as err:
        raise ObjectStorageError(
            f"--enable-msc needs the Multi-Storage Client, which is not installed ({err}); "
            f"{INSTALL_HINT}") from None
    return multistorageclient


def split_url(url: str) -> tuple:
    """``msc://PROFILE/PATH`` -> (PROFILE, PATH); a URL without both is an error."""
    rest = url[len(MSC_PREFIX):] if is_msc_url(url) else ""
    profile, _, path = rest.partition("/")
    if not profile or not path.strip("/"):
        raise ObjectStorageError(f"{url!r}: expected msc://PROFILE/PATH (a profile of the MSC "
                                 "configuration, then a path inside it)")
    return profile, path


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/")] + [p.strip("/") for p in parts if p])


def size(url: str) -> Optional[int]:
    """The object's size in bytes, or None when it does not exist."""
    msc = client()
    try:
        if not msc.is_file(url):
            return None
        return int(msc.info(url).content_length)
    except FileNotFoundError:
        return None
    except Exception as err:  # profile missing, credentials, network: name the URL
        raise ObjectStorageError(f"{url}: the Multi-Storage Client failed: "
                                 f"{type(err).__name__}: {err}") from None
