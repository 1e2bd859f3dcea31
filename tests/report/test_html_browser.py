"""The HTML report in headless Chromium: it renders without console errors, its table sorts, and a
screenshot is saved (slow; skipped when chromium is absent: `apt-get install -y chromium`)."""
import re
import shutil
import subprocess

import pytest

from qpasses.cli import main
from qpasses.cli.examples import write_example

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# clicks the "local SNR" header once (ascending) and lists the column as the page shows it
PROBE = """<script>
var th = Array.prototype.filter.call(document.querySelectorAll('th'), function (t) {
  return t.textContent.indexOf('local SNR') === 0; })[0];
th.click();
var col = Array.prototype.indexOf.call(th.parentNode.children, th);
var rows = th.closest('table').tBodies[0].rows;
document.body.setAttribute('data-sorted', Array.prototype.map.call(rows, function (r) {
  return r.cells[col].dataset.v; }).join(' '));
var shown = function () { return Array.prototype.filter.call(rows, function (r) { return r.offsetParent; }).length; };
var before = shown();
th.closest('table').nextSibling.click();   // "show all"
document.body.setAttribute('data-shown', before + ' ' + shown() + ' ' + rows.length);
</script></body>"""


def _chromium(tmp_path, page, *args):
    profile = tmp_path / "profile"
    proc = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                           *args, page.as_uri()], capture_output=True, text=True, timeout=180)
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc, console


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_the_report_renders_without_console_errors_and_sorts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("qpasses.report.html.CAP", 3)   # long tables show 3 rows until "show all"
    model, calib, evals = write_example(tmp_path)
    page = tmp_path / "report.html"
    assert main(["run", str(model), "-o", str(tmp_path / "q.onnx"), "--calib", str(calib), "--eval", str(evals),
                 "--html", str(page), "--quiet"]) == 0
    shot = tmp_path / "report.png"
    proc, console = _chromium(tmp_path, page, "--window-size=1280,3000", f"--screenshot={shot}")
    assert proc.returncode == 0 and not console, console
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", PROBE))
    proc, console = _chromium(tmp_path, probe, "--dump-dom")
    assert proc.returncode == 0 and not console, console
    values = [float(v) for v in re.search(r'data-sorted="([^"]*)"', proc.stdout).group(1).split()]
    assert len(values) >= 5 and values == sorted(values)
    before, after, total = map(int, re.search(r'data-shown="([^"]*)"', proc.stdout).group(1).split())
    assert (before, after) == (3, total) and total >= 5
