"""The few CUDA runtime calls torch does not expose: IPC handles, mapped host memory and the id of
a stream's graph capture.

Bound with ctypes to the ``libcudart`` that torch itself loaded, so both share one context.
"""

import ctypes

IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1
_HOST_ALLOC_MAPPED = 2
_lib = None


def _cudart() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        import torch

        torch.cuda.init()
        path = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcudart" in line:
                    path = line.split()[-1]
                    break
        _lib = ctypes.CDLL(path or "libcudart.so")
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        lib = _cudart()
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what} failed: {lib.cudaGetErrorString(rc).decode()} ({rc})")


def malloc(nbytes: int) -> int:
    ptr = ctypes.c_void_p()
    _check(_cudart().cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cudaMalloc")
    _check(_cudart().cudaMemset(ptr, 0, ctypes.c_size_t(nbytes)), "cudaMemset")
    _check(_cudart().cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    return ptr.value


def free(ptr: int) -> None:
    _check(_cudart().cudaFree(ctypes.c_void_p(ptr)), "cudaFree")


def ipc_handle(ptr: int) -> bytes:
    handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
    _check(_cudart().cudaIpcGetMemHandle(handle, ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
    return handle.raw


class _IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: a 64-byte struct, passed by value (a bare array would decay to a pointer)."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def ipc_open(handle: bytes) -> int:
    ptr = ctypes.c_void_p()
    fn = _cudart().cudaIpcOpenMemHandle
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
    struct = _IpcMemHandle()
    ctypes.memmove(ctypes.byref(struct), handle, IPC_HANDLE_BYTES)
    _check(fn(ctypes.byref(ptr), struct, _LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
    return ptr.value


def ipc_close(ptr: int) -> None:
    _check(_cudart().cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def host_alloc_mapped(nbytes: int) -> int:
    """Pinned host memory the GPU writes and the host reads without synchronizing (UVA: one address)."""
    ptr = ctypes.c_void_p()
    _check(_cudart().cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes), _HOST_ALLOC_MAPPED),
           "cudaHostAlloc")
    ctypes.memset(ptr, 0, nbytes)
    dev = ctypes.c_void_p()
    _check(_cudart().cudaHostGetDevicePointer(ctypes.byref(dev), ptr, 0), "cudaHostGetDevicePointer")
    if dev.value != ptr.value:
        free_host(ptr.value)
        raise RuntimeError("mapped host memory has a device address other than its host address (no UVA)")
    return ptr.value


def free_host(ptr: int) -> None:
    _check(_cudart().cudaFreeHost(ctypes.c_void_p(ptr)), "cudaFreeHost")


def memcpy_htod(dst: int, src: int, nbytes: int) -> None:
    _check(_cudart().cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), 1),
           "cudaMemcpy")


def capture_id(stream: int) -> int:
    """The unique id of the graph capture ``stream`` (a ``cudaStream_t``) takes part in; 0 if none.
    (CUDA 13's form takes seven parameters, passed here as NULL past the id; every older form
    shares the first three and ignores what follows.)"""
    status, ident = ctypes.c_int(), ctypes.c_ulonglong()
    _check(_cudart().cudaStreamGetCaptureInfo(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(ident),
                                              None, None, None, None), "cudaStreamGetCaptureInfo")
    return ident.value if status.value != 0 else 0  # (0: cudaStreamCaptureStatusNone)
