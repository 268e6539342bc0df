"""`make run`'s main job, in its short form: the same code path, ending with the right passkey."""

import os
import subprocess
import sys


def test_main_job_finds_the_passkey_across_three_instances():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-m", "infinite_llm.cli.demo", "--short"], capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert "found in the answer" in last and "spanned 3 instance(s)" in last
    assert "safe to stop" in result.stdout
    assert "stopped 4 daemons" in result.stdout
