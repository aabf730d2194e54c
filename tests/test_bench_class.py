"""`jax-kvalloc bench-class` runs end to end on tiny sizes and writes its record."""
import json

from jax_kvalloc.tools import bench_class
from jax_kvalloc.tools import cli


def test_bench_class_smoke(tmp_path, capsys):
  out = tmp_path / "bc.json"
  rc = cli.main(["bench-class", "--impls", "device,host,sgljax,nosuch", "--pool", "65536",
                 "--decode", "1,9", "--extend", "2", "--extend-tokens", "8", "--free", "64",
                 "--restore-decode", "8", "--restore-free", "64", "--reps", "2",
                 "--stalls", "3", "--stall-max-batch", "4", "--json", str(out)])
  assert rc == 0
  record = json.loads(out.read_text())
  assert set(record["rows"]) == {"decode/1", "decode/9", "extend/2", "free/64",
                                 "decode_after_restore/8", "free_after_restore/64"}
  for key, res in record["rows"].items():
    for name in ("device", "host"):
      assert res[name]["median_us"] > 0, (key, name, res[name])
    if "sgljax" not in record["skipped"]:
      assert res["sgljax"]["median_us"] > 0, (key, res["sgljax"])
  # sglang-jax is timed where its checkout is there; where not, the record says why
  # (an unknown name too): nothing is left out without a reason.
  assert ("sgljax" in record["skipped"]) != (
      bench_class.DEFAULT_SGLJAX / "sgljax_allocator.py").exists()
  assert all(why for why in record["skipped"].values())
  assert "nosuch" in record["skipped"]
  assert record["stalls"]["warm"]["calls"] == 3
  assert "host/sgljax" in capsys.readouterr().out
