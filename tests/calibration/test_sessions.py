"""onnxruntime session plumbing: every qpasses session waits without spinning."""
import onnx

from qpasses.calibration.sessions import ort_session, session_options
from qpasses.testing import parse

MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2] x) => (float[2] y) <float[2] w = {1.0, 2.0}>
{
    y = Mul(x, w)
}
"""


def test_sessions_do_not_spin_with_or_without_given_options():
    data = parse(MODEL).SerializeToString()
    given, _ = session_options(onnx.load_from_string(data))
    for sess in (ort_session(data), ort_session(data, given, optimization="none", threads=2)):
        assert sess.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
