"""``jaxpar inspect --hlo-file DUMP --mesh AXES`` end to end: a dump of jaxpar's own step tallies
as inspect reports that step, and misuse fails in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import assert_one_line_error, env_without_device_flags, run_jaxpar

# A module on 8 devices whose all-reduce's tuple elements are named %ar#0, %ar#1.
DUMP = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main {
  %a = f32[8]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %ar = (f32[8]{0}, f32[4]{0}) all-reduce(%a, %b), channel_id=1, replica_groups=[4,2]<=[8], \
use_global_device_ids=true, to_apply=%add
  ROOT %t = (f32[8]{0}, f32[4]{0}) tuple(%ar#0, %ar#1)
}
"""


def test_a_dump_of_jaxpars_own_step_tallies_as_inspect_reports_it(tmp_path):
    # The same program two ways: compiled and reported by `jaxpar inspect`, and read back from
    # the files XLA dumped while compiling it.
    layout = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    env = dict(env_without_device_flags(),
               XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=.*train_step.*")
    own = run_jaxpar("inspect", "tiny", *layout, "--devices", "8", "--json", "-", env=env)
    assert own.returncode == 0, own.stderr[-2000:]
    (dump,) = [p for p in tmp_path.iterdir() if p.name.endswith("after_optimizations.txt")]
    read = run_jaxpar("inspect", "--hlo-file", str(dump), "--mesh",
                      "pipe=1,data=2,fsdp=2,expert=1,context=1,tensor=2", "--json", "-",
                      env=env_without_device_flags())
    assert read.returncode == 0, read.stderr[-2000:]
    own, read = json.loads(own.stdout), json.loads(read.stdout)
    assert read["collectives"] == own["collectives"]
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes"):
        assert read["memory"][key] == own["memory"][key], key
    tables = run_jaxpar("inspect", "--hlo-file", str(dump), "--mesh", "data=2,fsdp=2,tensor=2",
                        env=env_without_device_flags())
    assert tables.returncode == 0 and "reduce-scatter" in tables.stdout, tables.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (("--hlo-file", "missing.txt", "--mesh", "data=8"), "no such file"),
    (("--hlo-file", "DUMP"), "--hlo-file and --mesh go together"),
    (("tiny", "--hlo-file", "DUMP", "--mesh", "data=8"), "with no CONFIG"),
    (("--hlo-file", "DUMP", "--mesh", "data=3"), "3 devices, but the dump's module runs on 8"),
    ((), "inspect needs CONFIG"),
])
def test_hlo_file_misuse_fails_in_one_line(tmp_path, args, needle):
    dump = tmp_path / "dump.txt"
    dump.write_text(DUMP)
    args = tuple(str(dump) if a == "DUMP" else a for a in args)
    result = run_jaxpar("inspect", *args, cwd=os.fspath(tmp_path),
                        env=env_without_device_flags())
    assert_one_line_error(result, needle)
    assert not Path(tmp_path / "missing.txt").exists()
