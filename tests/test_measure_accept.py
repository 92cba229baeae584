"""``fle-accept``: the KLD acceptance rule on synthetic results built to pass
and to fail, in the form fle-kld prints (fle_quant.kld.format_summary) and
as JSON summaries."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from fle_quant.cli.accept_cli import main
from fle_quant.kld import DP_PERCENTILES, KLD_PERCENTILES, KldSummary, format_summary
from fle_quant.measure.accept import read_kld_result


def summary(kld, kld_se, top, top_se):
    return KldSummary(count=1000, ppl=10.0, ppl_unc=0.1, ppl_base=9.9, ppl_base_unc=0.1, log_ppl_cor=0.99,
                      log_ppl_ratio=0.01, log_ppl_ratio_unc=0.001, ppl_ratio=1.01, ppl_ratio_unc=0.001,
                      ppl_diff=0.1, ppl_diff_unc=0.01, kld_mean=kld, kld_unc=kld_se,
                      kld_percentiles={k: kld for k, _ in KLD_PERCENTILES}, dp_mean=0.0, dp_unc=0.001,
                      dp_percentiles={k: 0.0 for k, _ in DP_PERCENTILES}, rms_dp=0.01, rms_dp_unc=0.001,
                      same_top=top / 100, same_top_unc=top_se / 100)


def write(tmp_path, name, kld, kld_se, top, top_se, as_json=False):
    s = summary(kld, kld_se, top, top_se)
    p = tmp_path / (name + (".json" if as_json else ".txt"))
    if as_json:
        p.write_text(json.dumps(dataclasses.asdict(s)))
    else:
        p.write_text("llama_perf ... chunk lines ...\n\n" + format_summary(s) + "\n")
    return str(p)


def run(tmp_path, texts, held, capsys):
    argv = []
    for i, (c, r) in enumerate(texts):
        argv += ["--text", f"t{i}", write(tmp_path, f"c{i}", *c), write(tmp_path, f"r{i}", *r, as_json=i % 2 == 1)]
    for i, (c, r) in enumerate(held):
        argv += ["--held-out", f"h{i}", write(tmp_path, f"hc{i}", *c), write(tmp_path, f"hr{i}", *r)]
    rc = main(argv + ["--json", str(tmp_path / "v.json")])
    return rc, capsys.readouterr(), json.loads((tmp_path / "v.json").read_text()) if rc in (0, 1) else None


REF = (0.050, 0.0010, 92.00, 0.05)
# two combined standard errors: 2 * sqrt(0.001**2 + 0.001**2) = 0.0028284
EDGE = 0.050 + 2 * math.sqrt(2) * 0.001


def test_reads_printed_and_json(tmp_path):
    r = read_kld_result(write(tmp_path, "a", 0.0123456, 0.000321, 91.234, 0.072))
    assert (r.kld, r.kld_se, r.top1, r.top1_se) == (0.012346, 0.000321, 91.234, 0.072)
    r = read_kld_result(write(tmp_path, "b", 0.0123456, 0.000321, 91.234, 0.072, as_json=True))
    assert r.kld == 0.0123456 and abs(r.top1 - 91.234) < 1e-9
    # llama-perplexity's own line with "+/-" as some terminals save it
    p = tmp_path / "l.txt"
    p.write_text("Mean    KLD:   0.064556 +/-   0.000584\nSame top p: 91.893 +/- 0.072 %\n")
    r = read_kld_result(p)
    assert (r.kld, r.kld_se, r.top1, r.top1_se) == (0.064556, 0.000584, 91.893, 0.072)


def test_accepted_within_the_rule(tmp_path, capsys):
    cand = (EDGE - 0.0001, 0.0010, 91.55, 0.05)  # just inside both limits
    rc, out, v = run(tmp_path, [(cand, REF), (cand, REF)], [(cand, REF)], capsys)
    assert rc == 0 and v["accepted"]
    assert "accepted: within the rule on 2 texts, confirmed on held-out h0" in out.out
    assert "| t0 |" in out.out and "h0 (held out)" in out.out
    assert all(t["ok"] for t in v["texts"])
    assert abs(v["texts"][0]["kld_limit"] - EDGE) < 1e-9


def test_refused_on_kld(tmp_path, capsys):
    bad = (EDGE + 0.0001, 0.0010, 92.0, 0.05)
    rc, out, v = run(tmp_path, [(REF, REF), (bad, REF)], [(REF, REF)], capsys)
    assert rc == 1 and not v["accepted"]
    assert "fails the rule on t1" in out.out and "NO (KLD)" in out.out
    assert [t["ok"] for t in v["texts"]] == [True, False, True]


def test_refused_on_top1(tmp_path, capsys):
    bad = (0.050, 0.0010, 91.45, 0.05)  # 0.55 points worse
    rc, out, v = run(tmp_path, [(bad, REF)], [(REF, REF)], capsys)
    assert rc == 1 and "NO (top-1)" in out.out
    assert abs(v["texts"][0]["top1_drop_points"] - 0.55) < 1e-9


def test_held_out_must_confirm(tmp_path, capsys):
    good = (0.049, 0.0010, 92.1, 0.05)
    bad = (0.060, 0.0010, 92.1, 0.05)
    rc, out, v = run(tmp_path, [(good, REF), (good, REF)], [(bad, REF)], capsys)
    assert rc == 1 and "held-out text h0" in out.out and "does not confirm" in out.out


def test_bad_input(tmp_path, capsys):
    p = tmp_path / "x.txt"
    p.write_text("nothing here\n")
    good = write(tmp_path, "g", *REF)
    assert main(["--text", "a", str(p), good, "--held-out", "b", good, good]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "x.txt" in err and "Mean    KLD" in err
    j = tmp_path / "j.json"
    j.write_text('{"kld_mean": 0.1, "kld_unc": 0.01, "same_top": 0.9}')
    assert main(["--held-out", "b", str(j), good]) == 2
    err = capsys.readouterr().err
    assert "j.json" in err and "same_top_unc" in err
    assert main(["--text", "a", good, good, "--held-out", "a", good, good]) == 2
    assert "twice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--text", "a", good, good])  # no held-out text
    assert e.value.code == 2


def test_texts_rebuilt(tmp_path, capsys):
    """The Python reference offline; manifest texts fetched from a loopback
    server and checked against their SHA-256."""
    import hashlib
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from fle_quant.measure.texts import python_reference

    body = "Kubernetes README stand-in\n".encode() * 50

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path != "/k8s.md":
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        good = tmp_path / "m.json"
        good.write_text(json.dumps({"texts": [{"name": "k8s", "url": url + "/k8s.md",
                                               "sha256": hashlib.sha256(body).hexdigest()}]}))
        out = tmp_path / "texts"
        assert main(["texts", "-o", str(out), "--manifest", str(good)]) == 0
        said = capsys.readouterr().out
        assert (out / "k8s.txt").read_bytes() == body
        py = (out / "python-reference.txt").read_bytes()
        assert py == python_reference() and len(py) > 100_000 and b"\nif\n==\n" in py
        assert hashlib.sha256(py).hexdigest() in said
        bad = tmp_path / "b.json"
        bad.write_text(json.dumps({"texts": [{"name": "k8s", "url": url + "/k8s.md", "sha256": "0" * 64}]}))
        assert main(["texts", "-o", str(tmp_path / "t2"), "--manifest", str(bad)]) == 2
        err = capsys.readouterr().err
        assert "SHA-256" in err and "nothing was written" in err and not (tmp_path / "t2").exists()
        missing = tmp_path / "x.json"
        missing.write_text(json.dumps({"texts": [{"name": "w", "url": url + "/nope", "sha256": "0" * 64}]}))
        assert main(["texts", "-o", str(tmp_path / "t3"), "--manifest", str(missing)]) == 2
        assert "HTTP 404" in capsys.readouterr().err
        assert main(["texts", "-o", str(out), "--manifest", str(good)]) == 2  # exists, no --force
        assert "exists" in capsys.readouterr().err
    finally:
        srv.shutdown()
        srv.server_close()


def test_report_texts_recorded_then_checked(tmp_path, capsys):
    """The project's manifest of the report's texts with its URLs pointed at
    a loopback server standing in for Wikipedia and GitHub: unpinned texts
    refused without --record, recorded once, then rebuilt and checked; a
    changed source is refused and writes nothing; --offline writes E only."""
    import hashlib
    import platform
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlparse

    from fle_quant.measure.texts import python_reference, report_manifest

    obj, texts = report_manifest()
    assert len([t for t in texts if t.get("part_of") == "W"]) == 4
    assert len([t for t in texts if t.get("part_of") == "K"]) == 7
    assert all(t["sha256"] is None and t["note"] for t in texts if t.get("url"))  # the report gives no hash
    assert all("4472af456106" in t["url"] for t in texts if t.get("part_of") == "K")
    pages = {}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        for t in texts:
            if t.get("url"):
                u = urlparse(t["url"])
                path = u.path + (f"?{u.query}" if u.query else "")
                t["url"] = base + path
                pages[path] = f"{t['name']} text\n".encode() * 20
        m = tmp_path / "report.json"
        m.write_text(json.dumps(obj))
        out = tmp_path / "t"
        assert main(["texts", "-o", str(out), "--manifest", str(m)]) == 2
        err = capsys.readouterr().err
        assert "no SHA-256" in err and "--record" in err and err.count("\n") == 1 and not out.exists()
        rec = tmp_path / "recorded.json"
        assert main(["texts", "-o", str(out), "--manifest", str(m), "--record", str(rec)]) == 0
        capsys.readouterr()
        r = json.loads(rec.read_text())
        by = {t["name"]: t for t in r["texts"]}
        for t in texts:
            if t.get("url"):
                assert by[t["name"]]["sha256"] == hashlib.sha256(pages[urlparse(t["url"]).path + (
                    "?" + urlparse(t["url"]).query if urlparse(t["url"]).query else "")]).hexdigest()
        py = python_reference()
        assert by["E"]["sha256_by_python"][platform.python_version()] == hashlib.sha256(py).hexdigest()
        assert (out / "E.txt").read_bytes() == py
        w_parts = [(out / f"{t['name']}.txt").read_bytes() for t in texts if t.get("part_of") == "W"]
        assert (out / "W.txt").read_bytes() == b"\n\n".join(w_parts) and (out / "K.txt").exists()
        # rebuilt from the recorded manifest: checked
        assert main(["texts", "-o", str(tmp_path / "t2"), "--manifest", str(rec)]) == 0
        capsys.readouterr()
        assert (tmp_path / "t2" / "K.txt").read_bytes() == (out / "K.txt").read_bytes()
        # an article edited since it was recorded
        key = next(k for k in pages if "Gleitkommazahl" in k)
        pages[key] = b"edited\n"
        assert main(["texts", "-o", str(tmp_path / "t3"), "--manifest", str(rec)]) == 2
        err = capsys.readouterr().err
        assert "W-gleitkommazahl" in err and "nothing was written" in err and not (tmp_path / "t3").exists()
        # offline: the built-in text only
        assert main(["texts", "-o", str(tmp_path / "t4"), "--offline"]) == 0
        said = capsys.readouterr().out
        assert sorted(p.name for p in (tmp_path / "t4").iterdir()) == ["E.txt"] and "skipped K-" in said
        # bad manifests: one line naming the field
        for bad, word in (({"texts": [{"name": "a", "url": "ftp://x", "sha256": None}]}, "texts[0].url"),
                          ({"texts": [{"name": "a", "url": base + "/a", "colour": 1}]}, "'colour'"),
                          ({"texts": [{"name": "a", "builtin": "other"}]}, "texts[0].builtin"),
                          ({"texts": [{"name": "W", "url": base + "/a"}, {"name": "b", "url": base + "/b",
                                                                         "part_of": "W"}]}, "part_of")):
            f = tmp_path / "bad.json"
            f.write_text(json.dumps(bad))
            assert main(["texts", "-o", str(tmp_path / "t5"), "--manifest", str(f)]) == 2
            err = capsys.readouterr().err
            assert word in err and err.count("\n") == 1, err
    finally:
        srv.shutdown()
        srv.server_close()
