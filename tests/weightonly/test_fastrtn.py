"""fastrtn (the default RTN's short path) gives the codes, scales and zero points of the plain
chunked RTN (rtn.choose_params + rtn.centered_codes) bit for bit, packed into B or not."""
import numpy as np
import pytest

from qpasses.weightonly import fastrtn, rtn
from qpasses.weightonly.blocks import Blocked, columns_of
from qpasses.weightonly.matmulnbits import nbits_inputs, pack_b


def plain(w, bits, block, symmetric, refine):
    blocks = columns_of(w, block)
    s, z = rtn.choose_params(blocks, bits, symmetric, refine, axis=1)
    codes = (rtn.centered_codes(blocks, s, z, bits, axis=1) + z[:, None, :]).astype(np.uint8)
    return Blocked(codes, np.ascontiguousarray(s.T), np.ascontiguousarray(z.T.astype(np.uint8)), w.shape[0], bits,
                   symmetric, columns=True)


def weight(k, n, seed, scale=0.05):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * scale).astype(np.float32)
    w[rng.random((k, n)) < 0.02] *= 30       # outliers: clipped codes, refits that move the scale
    w[:, :1] = 0                             # an all-zero column: scale 0
    if n > 2:
        w[: min(k, 32), 1] = np.float32(3e-39)   # subnormal blocks (the reciprocal overflows)
        w[0, 2] = -w[0, 2]
    return w


pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")   # subnormal blocks

SHAPES = [(64, 1), (96, 3), (200, 48), (256, 64), (768, 130)]


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bits,block,symmetric", [(4, 32, True), (4, 32, False), (4, 16, True), (8, 64, False),
                                                  (8, 128, True)])
@pytest.mark.parametrize("chunk", [1, 1 << 18])
def test_fast_rtn_is_the_plain_rtn(monkeypatch, k, n, bits, block, symmetric, chunk):
    w = weight(k, n, k + n + bits)
    want = plain(w, bits, block, symmetric, rtn.REFINE)
    monkeypatch.setattr(rtn, "CHUNK", chunk)
    got = rtn.quantize_rtn(w, bits, block, symmetric)
    for field in ("codes", "scales", "zero_points"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    packed = rtn.quantize_rtn(w, bits, block, symmetric, pack=True)
    np.testing.assert_array_equal(pack_b(packed), pack_b(want))
    for key, value in nbits_inputs(packed).items():
        expected = nbits_inputs(want)[key]
        assert (value is None) == (expected is None)
        if value is not None:
            np.testing.assert_array_equal(value, expected)
    if bits == 4:
        assert packed.codes is None and packed.block_size == block and packed.n == n
        np.testing.assert_array_equal(packed.kn_codes(), want.kn_codes())
        np.testing.assert_array_equal(packed.dequantize(), want.dequantize())


@pytest.mark.parametrize("refine", [0, 2])
def test_other_refit_counts(refine):
    w = weight(160, 40, refine)
    for symmetric in (True, False):
        want, got = plain(w, 4, 32, symmetric, refine), rtn.quantize_rtn(w, 4, 32, symmetric, refine=refine, pack=True)
        np.testing.assert_array_equal(pack_b(got), pack_b(want))
        np.testing.assert_array_equal(got.scales, want.scales)


def test_without_einsum_sums_the_same(monkeypatch):
    w = weight(256, 96, 7)
    monkeypatch.setattr(fastrtn, "einsum_sums_in_order", lambda: False)
    for symmetric in (True, False):
        got, want = rtn.quantize_rtn(w, 4, 32, symmetric), plain(w, 4, 32, symmetric, rtn.REFINE)
        np.testing.assert_array_equal(got.codes, want.codes)
        np.testing.assert_array_equal(got.scales, want.scales)


def test_einsum_probe_holds_here():
    """If it ever fails (a numpy whose einsum fuses multiply-adds), fastrtn falls back to products
    then sums: slower, same bytes. Here it should hold, or the speed in tools/README.md is not ours."""
    assert fastrtn.einsum_sums_in_order()


def test_weighted_or_searched_rtn_takes_the_general_path():
    w = weight(96, 24, 3)
    got = rtn.quantize_rtn(w, 4, 32, True, channel_weights=np.ones(96, np.float32), pack=True)
    assert got.codes is not None and got.packed is None


def test_onnxruntimes_compiled_rtn_is_no_drop_in_for_ours():
    """onnxruntime's quantize_matmul_4bits (its RTN kernel) rounds exact .5 ties up, ours to even, and
    has no refit: it cannot stand in for our RTN (tools/README.md, "Time after issue 17i")."""
    kernel = pytest.importorskip("onnxruntime.capi._pybind_state").quantize_matmul_4bits
    w = np.zeros((64, 8), np.float32)
    w[0] = -8.0   # each first block's scale is 1
    w[1:9] = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5], np.float32)[:, None]
    b, scales = np.zeros((8, 2, 16), np.uint8), np.zeros((8, 2), np.float32)
    kernel(b, w, scales, np.zeros((8, 1), np.uint8), 32, 8, 64, True)
    theirs = np.stack([b & 15, b >> 4], axis=-1).reshape(8, 64)[0, 1:9].astype(int) - 8
    ours = rtn.quantize_rtn(w, 4, 32, True, refine=0, pack=True)
    assert theirs.tolist() == [1, 2, 3, 0, -1, -2, 4, -3]
    assert (ours.kn_codes()[1:9, 0].astype(int) - 8).tolist() == [0, 2, 2, 0, -2, -2, 4, -4]
    np.testing.assert_array_equal(ours.scales[:, 0], scales[:, 0])


@pytest.mark.parametrize("wo", [{"format": "matmulnbits"}, {"format": "matmulnbits", "symmetric": False},
                                {"format": "qdq"}, {"format": "matmulnbits", "bits": 8},
                                {"format": "matmulnbits", "block_size": 16}])
@pytest.mark.parametrize("gemm_trans", [False, True])
def test_the_pass_writes_the_same_model_without_fastrtn(monkeypatch, wo, gemm_trans):
    import hashlib

    from qpasses.api import run_pipeline
    from tests.passes.test_quantize_weights import mlp

    proto, _ = mlp(k=96, n=40, gemm_trans=gemm_trans, outliers=True)

    def digest():
        model, _ = run_pipeline(proto, "quantize-weights", config={"mode": "weight_only",
                                                                   "weight_only": {"algorithm": "rtn", **wo}})
        return hashlib.sha256(model.to_proto(metadata=False).SerializeToString()).hexdigest()
    fast = digest()
    monkeypatch.setattr(fastrtn, "applies", lambda blocks, bits: False)
    assert digest() == fast
