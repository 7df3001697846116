"""The README's commands are the ones CI runs, and the example runs."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.strip() for line in block.strip().splitlines()]


def test_readme_starts_with_two_commands_and_ci_runs_the_test_one():
    commands = readme_commands()
    assert len(commands) == 2
    assert "examples/train_mlp.py" in commands[0]
    assert "pytest" in commands[1]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert commands[1] in ci.splitlines()


def test_example_trains_and_matches_eager():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)  # the example sets things up itself, as for a user
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_mlp.py"), "--steps", "8"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ran: interpret" in result.stdout
    assert "fallbacks: none" in result.stdout


def test_complex_filter_example_matches_eager():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "complex_filter.py"), "--steps", "6"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ran: interpret" in result.stdout and "fallbacks: none" in result.stdout
