"""Compile squash's FFI kernels now, so the first `tune run` does not (a Docker image build runs
this). A GPU is not needed to compile: set TORCH_CUDA_ARCH_LIST (CUDA) or PYTORCH_ROCM_ARCH
(ROCm) to the architectures to build for.

    python scripts/prebuild_kernels.py cpu cuda     # device types: cpu, cuda (CUDA or ROCm)

Exits 1 naming each device type whose kernels did not build.
"""

import sys
import warnings

from squash.ops import _loader


def main(device_types) -> int:
    failed = []
    for device_type in device_types:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = _loader.ensure_loaded(device_type)
        for w in caught:
            print(w.message, file=sys.stderr)
        print(f"{device_type}: {'built' if ok else 'NOT built'}")
        if not ok:
            failed.append(device_type)
    if failed:
        print(f"kernels not built for: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["cpu"]))
