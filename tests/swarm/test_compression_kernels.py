"""The compiled quantization kernels against the pure-torch reference, the loader, and the CUDA sources' build.

Bit-exact equality is the contract: C++ (and CUDA, where a GPU exists) must produce the same payload bytes and
the same accumulated float32 bits as kernels/reference.py, for nearest and stochastic rounding alike.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from moshpeer.compression.kernels import ENV_BACKEND, KernelUnavailable, load_backend, loader
from moshpeer.compression.quantization import BlockQuantizer
from moshpeer.errors import ProtocolError

pytestmark = pytest.mark.timeout(300)

# The CUDA backend is a parameter of its own, marked `cuda`, so `pytest -m cuda` (benchmarks/gpu_suite.sh) runs it.
COMPILED = ["cpp", pytest.param("cuda", marks=[pytest.mark.cuda,
                                               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
SIZES = [0, 1, 2, 15, 63, 64, 65, 127, 128, 129, 1000, 4097, 70001]
CODECS = [(8, 128), (4, 128), (8, 64), (4, 1024), (4, 80)]


def device_of(backend: str) -> torch.device:
    return torch.device("cuda" if backend == "cuda" else "cpu")


def heavy_tailed(numel: int, seed: int = 0) -> torch.Tensor:
    """Gradient-like data: Student-t values with per-region scales spanning several orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(3.0).sample((numel,)) if numel else torch.zeros(0)
    scale = torch.exp(torch.randn(numel, generator=g) * 2.0)
    return (t * scale).float()


def encode_with(monkeypatch, backend: str, codec: BlockQuantizer, x: torch.Tensor, seed: int) -> torch.Tensor:
    monkeypatch.setenv(ENV_BACKEND, backend)
    return codec.encode(x.to(device_of(backend)), seed=seed).cpu()


def decode_with(monkeypatch, backend: str, codec: BlockQuantizer, payload: torch.Tensor, out: torch.Tensor,
                weight: float) -> torch.Tensor:
    monkeypatch.setenv(ENV_BACKEND, backend)
    out = out.clone().to(device_of(backend))
    codec.decode_accumulate(payload.to(out.device), out, weight)
    return out.cpu()


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("bits,block", CODECS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_backend_equals_reference_bit_for_bit(monkeypatch, backend, bits, block, stochastic):
    torch.manual_seed(bits * block)
    codec = BlockQuantizer(bits, block, stochastic)
    for numel in SIZES:
        x = heavy_tailed(numel, seed=numel)
        expected = encode_with(monkeypatch, "torch", codec, x, seed=numel + 7)
        got = encode_with(monkeypatch, backend, codec, x, seed=numel + 7)
        assert torch.equal(got, expected), f"encode differs for numel={numel}"
        out = torch.randn(numel)
        expected_out = decode_with(monkeypatch, "torch", codec, expected, out, 0.37)
        got_out = decode_with(monkeypatch, backend, codec, expected, out, 0.37)
        assert torch.equal(got_out.view(torch.int32), expected_out.view(torch.int32)), f"decode differs, numel={numel}"


@pytest.mark.parametrize("backend", ["torch"] + COMPILED)
@pytest.mark.parametrize("bits,block", [(8, 128), (4, 128), (8, 64), (4, 1024)])
@pytest.mark.parametrize("offset", [0, 1])  # x 16-byte aligned (the CUDA kernel's float4 loads) or not
@pytest.mark.parametrize("blocks_per_chunk", [32, 3])  # 7 x 3 blocks: the CUDA kernel's groups of blocks per warp
def test_encode_chunks_rows_are_the_payloads_of_encode(monkeypatch, backend, bits, block, offset, blocks_per_chunk):
    """`encode_chunks` (one `quantize_rows` call for the full chunks) writes in each row the bytes `encode` makes
    for that chunk alone; a chunk with a NaN, or with a value above the scale bound, is reported alone. With 3
    blocks per chunk the CUDA kernel's groups of blocks straddle chunks, and the last group is partial."""
    monkeypatch.setenv(ENV_BACKEND, backend)
    codec, n = BlockQuantizer(bits, block), blocks_per_chunk * block
    base = heavy_tailed(offset + 6 * n + 100, seed=bits + block)
    base[offset + 2 * n + 17] = float("nan")
    base[offset + 4 * n + 5] = 3e38  # finite, but its scale exceeds MAX_SCALE (2^120)
    x = base[offset:].to(device_of(backend))
    encoded = codec.encode_chunks(x, n, list(range(7)))
    errors = encoded.errors
    assert [e is not None for e in errors] == [False, False, True, False, True, False, False], errors
    assert "non-finite" in errors[2] and "above" in errors[4]
    for r in (0, 1, 3, 5, 6):
        expected = codec.encode(x[r * n:(r + 1) * n].cpu(), seed=r)
        assert encoded.nbytes[r] == expected.numel()
        assert torch.equal(encoded.buffer[r, :encoded.nbytes[r]].cpu(), expected), (backend, r)


@pytest.mark.parametrize("backend", ["torch"] + COMPILED)
@pytest.mark.parametrize("bits,block", [(8, 128), (4, 128), (4, 1024)])
def test_decode_chunks_gives_the_bits_of_decoding_chunk_by_chunk(monkeypatch, backend, bits, block):
    """`decode_chunks` (rows decoded where they lie, `dequantize_rows`, where the backend has it) writes the bits
    that `decode_into` / `decode_accumulate` give chunk by chunk, for both modes and a weight."""
    monkeypatch.setenv(ENV_BACKEND, backend)
    device = device_of(backend)
    codec, n, count = BlockQuantizer(bits, block), 2048, 5
    encoded = codec.encode_chunks(heavy_tailed(count * n, seed=bits).to(device), n, list(range(count)))
    start = heavy_tailed(count * n, seed=99).to(device)
    for modes in (["into"] * count, ["add"] * count, ["add", "into", None, "into", "add"]):
        batched = start.clone()
        errors = codec.decode_chunks(encoded.buffer, encoded.nbytes, batched, n, modes, weight=0.37)
        assert errors == [None] * count
        expected = start.clone()
        for r, mode in enumerate(modes):
            if mode is not None:
                target = expected[r * n:(r + 1) * n]
                (codec.decode_into if mode == "into" else codec.decode_accumulate)(encoded.payload(r), target, 0.37)
        assert torch.equal(batched.cpu().view(torch.int32), expected.cpu().view(torch.int32)), (backend, modes)


@pytest.mark.parametrize("backend", ["torch"] + COMPILED)
@pytest.mark.parametrize("bits,block", CODECS)
def test_decode_into_equals_accumulating_onto_zeros(monkeypatch, backend, bits, block):
    """decode_into overwrites in one pass: the bits of decode_accumulate onto zeros, whatever `out` held."""
    codec = BlockQuantizer(bits, block)
    for numel in SIZES:
        payload = encode_with(monkeypatch, "torch", codec, heavy_tailed(numel, seed=numel), seed=1)
        expected = decode_with(monkeypatch, "torch", codec, payload, torch.zeros(numel), 0.37)
        monkeypatch.setenv(ENV_BACKEND, backend)
        out = torch.full((numel,), float("nan"), device=device_of(backend))
        codec.decode_into(payload.to(out.device), out, 0.37)
        assert torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32)), (backend, numel)


@pytest.mark.parametrize("backend", ["torch"] + COMPILED)
def test_decode_into_leaves_out_alone_when_the_payload_is_bad(monkeypatch, backend):
    monkeypatch.setenv(ENV_BACKEND, backend)
    codec = BlockQuantizer(8, 128)
    payload = codec.encode(torch.randn(1000))
    payload[-1001 - 4] = 0xFF  # inside the last scale's bytes: a NaN scale
    out = torch.arange(1000, dtype=torch.float32, device=device_of(backend))
    with pytest.raises(ProtocolError):
        codec.decode_into(payload.to(out.device), out)
    assert torch.equal(out.cpu(), torch.arange(1000, dtype=torch.float32))


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_input_dtypes_and_non_contiguous_inputs(monkeypatch, backend, dtype):
    codec = BlockQuantizer(4, 128, stochastic=True)
    base = heavy_tailed(3 * 1001, seed=5).clamp(-6e4, 6e4).to(dtype)
    for x in (base, base[::3], base.view(3, 1001).t(), base.view(3, 1001)[:, 1:]):
        assert torch.equal(encode_with(monkeypatch, backend, codec, x, 11), encode_with(monkeypatch, "torch", codec, x, 11))
        # the codec reads any layout / dtype as the flat float32 vector of its values
        assert torch.equal(encode_with(monkeypatch, backend, codec, x, 11),
                           encode_with(monkeypatch, backend, codec, x.float().contiguous().reshape(-1), 11))


@pytest.mark.parametrize("backend", COMPILED)
def test_special_blocks(monkeypatch, backend):
    """All-zero, subnormal, tiny (inverse scale overflows), huge and signed-zero blocks encode identically."""
    tiny = torch.full((128,), 1e-38)
    blocks = [torch.zeros(128), torch.full((128,), 1e-45), tiny, -tiny, torch.full((128,), 1e36),
              torch.full((128,), -0.0), torch.linspace(-1, 1, 128) * 1e36, torch.tensor([0.5, -0.5, 1.5, 2.5] * 32)]
    x = torch.cat(blocks)
    for bits in (8, 4):
        for stochastic in (False, True):
            codec = BlockQuantizer(bits, 128, stochastic)
            expected = encode_with(monkeypatch, "torch", codec, x, 3)
            assert torch.equal(encode_with(monkeypatch, backend, codec, x, 3), expected)
            decoded = codec.decode(expected, x.numel())
            assert torch.isfinite(decoded).all()
            assert torch.equal(decoded[:128 * 4], torch.zeros(128 * 4))  # zero / denormal / tiny blocks


@pytest.mark.parametrize("backend", ["torch"] + COMPILED)
def test_values_beyond_the_scale_limit_are_refused(monkeypatch, backend):
    monkeypatch.setenv(ENV_BACKEND, backend)
    with pytest.raises(ValueError, match="above"):
        BlockQuantizer(4).encode(torch.full((10,), -3e38, device=device_of(backend)))


@pytest.mark.parametrize("backend", ["torch"] + COMPILED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(monkeypatch, backend, bad):
    x = torch.randn(1000)
    x[517] = bad
    monkeypatch.setenv(ENV_BACKEND, backend)
    for bits in (8, 4):
        with pytest.raises(ValueError, match="non-finite"):
            BlockQuantizer(bits).encode(x.to(device_of(backend)))


def test_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    """A compile error (real one: broken sources) gives one warning and the reference; forcing it raises."""
    broken = tmp_path / "src"
    broken.mkdir()
    for name in loader.CPU_SOURCES + loader.CPU_HEADERS:
        (broken / name).write_text("#error deliberately broken for the fallback test\n")
    monkeypatch.setattr(loader, "SOURCE_DIR", broken)
    monkeypatch.setenv(loader.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_loaded", {"torch": loader.TorchBackend()})
    monkeypatch.setattr(loader, "_failed", {})
    monkeypatch.setattr(loader, "_warned", set())
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loader.backend_for(torch.device("cpu")).name == "torch"
        assert loader.backend_for(torch.device("cpu")).name == "torch"
    assert len([w for w in caught if "reference" in str(w.message)]) == 1
    monkeypatch.setenv(ENV_BACKEND, "cpp")
    with pytest.raises(KernelUnavailable):
        loader.backend_for(torch.device("cpu"))
    x = torch.randn(300)
    monkeypatch.setenv(ENV_BACKEND, "torch")
    payload = BlockQuantizer(8).encode(x)  # the codec still works through the reference
    assert (BlockQuantizer(8).decode(payload, 300) - x).abs().max() <= x.abs().max() / 254 * 1.0001


def test_unknown_forced_backend_is_rejected(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "fortran")
    with pytest.raises(KernelUnavailable, match="fortran"):
        loader.backend_for(torch.device("cpu"))


def test_build_cache_is_keyed_by_sources_and_flags():
    files = loader.CPU_SOURCES + loader.CPU_HEADERS
    assert loader.build_hash(files, ["-O3"]) == loader.build_hash(files, ["-O3"])
    assert loader.build_hash(files, ["-O3"]) != loader.build_hash(files, ["-O2"])
    assert loader.build_hash(files, ["-O3"]) != loader.build_hash(files[:-1], ["-O3"])
    assert load_backend("cpp").name == "cpp"
    built = list(loader.cache_root().glob("moshpeer_cpu-*/built.ok"))
    assert built, "the C++ build should be cached"


def find_nvcc():
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def find_cuda_include(nvcc: str):
    """The CUDA include directory: nvcc may be a wrapper script, so ask it, then try the usual places."""
    candidates = []
    probe = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", "/dev/null"], capture_output=True, text=True)
    for line in probe.stderr.splitlines():
        if "INCLUDES=" in line:
            candidates += [p.strip('"').removeprefix("-I") for p in line.split("=", 1)[1].split()]
    candidates += [str(Path(nvcc).resolve().parent.parent / "include"), "/usr/local/cuda/include"]
    for candidate in candidates:
        if (Path(candidate) / "cuda_runtime.h").exists():
            return candidate
    return None


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_sources_compile_with_plain_nvcc(tmp_path, arch):
    """The .cu file has no torch headers, so plain nvcc builds it even on machines without a GPU."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (looked on PATH and in /usr/local/cuda/bin)")
    number = arch.split("_")[1]
    result = subprocess.run(
        [nvcc, "-c", "-O3", "--fmad=false", f"-gencode=arch=compute_{number},code={arch}",
         f"-I{loader.SOURCE_DIR}", str(loader.SOURCE_DIR / "quant_cuda.cu"), "-o", str(tmp_path / "quant_cuda.o")],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "quant_cuda.o").stat().st_size > 0


def test_cuda_binding_parses(tmp_path):
    """The torch side of the CUDA extension compiles (syntax and types) against this torch's headers."""
    nvcc = find_nvcc()
    compiler = shutil.which("c++") or shutil.which("g++")
    if nvcc is None or compiler is None:
        pytest.skip("needs nvcc (for the CUDA runtime headers) and a C++ compiler")
    from torch.utils import cpp_extension

    cuda_include = find_cuda_include(nvcc)
    if cuda_include is None:
        pytest.skip("CUDA runtime headers (cuda_runtime.h) not found")
    # CPU builds of torch ship the c10/cuda headers without this generated one; it only holds build macros.
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{tmp_path}", f"-I{cuda_include}",
                                                                      f"-I{loader.SOURCE_DIR}"]
    result = subprocess.run([compiler, "-std=c++20", "-fsyntax-only", *includes,
                             str(loader.SOURCE_DIR / "binding_cuda.cpp")], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
