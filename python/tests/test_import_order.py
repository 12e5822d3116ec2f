"""Importing diffcomm never changes which NCCL / CUDA libraries torch binds
to (issue [1/8]): the extension links no NCCL of its own (torch's NCCL group
carries "nccl"), so `import diffcomm` before `import torch` and a CUDA
library path of torch work. With torch from PyPI (a CUDA build, even on a
machine without a GPU) this failed with `undefined symbol: ncclCommResume`
when diffcomm loaded the toolkit's libnccl.so.2 first."""
import subprocess
import sys

import diffcomm


def test_diffcomm_first_then_torchs_cuda_libraries():
    code = ("import diffcomm, diffcomm.torch\n"
            "import torch\n"
            "import torch.distributed\n"
            "torch.cuda.is_available()\n"
            "print('OK', torch.__version__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_the_extension_links_no_nccl():
    import os  # noqa: PLC0415

    path = diffcomm._core.__file__
    if not os.path.exists("/proc/self/maps"):
        return
    r = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({path!r}); "
                        "print(open('/proc/self/maps').read())"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "libnccl" not in r.stdout, "the extension loaded an NCCL library"
