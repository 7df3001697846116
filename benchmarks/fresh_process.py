"""Calling a function in a fresh process, with environment variables of its own.

``call("module:function", request, env, log_path, timeout, fork=...)`` runs
``function(request)`` (JSON in, JSON out) in a new process whose ``os.environ`` has ``env``
added, its output going to ``log_path``, and returns the result. Two ways to get the process:

- a subprocess, ``python -m benchmarks.fresh_process call ...``, per call;
- ``fork=True``: a fork of a server (``python -m benchmarks.fresh_process serve``, started once
  and kept) that has imported torch and our compiler and done nothing else. Each call then
  costs a fork instead of an interpreter start and ``import torch``: seconds on a small
  machine. Only where no GPU is in use: a process that asked ``torch.cuda.is_available()``
  is not safe to fork from.

>>> call("os.path:basename", "/a/b", {}, os.devnull, 60)
'b'
"""

import compiler  # noqa: F401  (first: before anything imports triton, in the server too)

import atexit  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MARK = "FRESH-PROCESS-RESULT "
_server = None


class FreshProcessError(RuntimeError):
    pass


def call(target: str, request, env: dict, log_path: str, timeout: float, fork: bool = False):
    """``target(request)`` in a fresh process; raises FreshProcessError if it does not answer."""
    if fork:
        return _ask_server({"target": target, "request": request, "env": env, "log": log_path, "timeout": timeout})
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.fresh_process", "call", target, json.dumps(request)],
                cwd=ROOT, env=_environment(env), stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise FreshProcessError(f"ran past {timeout:.0f} s") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise FreshProcessError(f"exit {proc.returncode}: {_last_line(log_path)}")


def _environment(extra):
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


# -- the fork server -------------------------------------------------------------------------------
def _ask_server(message):
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-m", "benchmarks.fresh_process", "serve"], cwd=ROOT,
                                   env=_environment({}), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
        atexit.register(_stop_server, _server)
    _server.stdin.write(json.dumps(message) + "\n")
    _server.stdin.flush()
    line = _server.stdout.readline()
    if not line:
        raise FreshProcessError("the fork server exited")
    reply = json.loads(line)
    if "failure" in reply:
        raise FreshProcessError(reply["failure"])
    return reply["result"]


def _stop_server(server):
    if server.poll() is None:
        server.stdin.close()  # end of input: the server returns
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def serve():
    """One request per input line; each runs in a forked child; one reply per output line."""
    replies = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the real stdout
    for line in sys.stdin:
        message = json.loads(line)
        replies.write(json.dumps(_fork_and_run(message)) + "\n")
        replies.flush()


def _fork_and_run(message):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own environment and output, one call, then exit at once
        os.close(read_end)
        code = 1
        try:
            os.environ.update(message["env"])
            log = os.open(message["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            result = _run_target(message["target"], message["request"])
            with os.fdopen(write_end, "w") as out:
                out.write(json.dumps(result))
            code = 0
        except BaseException:
            traceback.print_exc()  # into the log, whose last line the caller reports
        finally:
            os._exit(code)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], message["timeout"])
    if not ready:
        os.kill(pid, signal.SIGKILL)
    with os.fdopen(read_end) as answer:
        text = answer.read() if ready else ""
    _, status = os.waitpid(pid, 0)
    if not ready:
        return {"failure": f"ran past {message['timeout']:.0f} s"}
    if not text:
        return {"failure": f"exit status {status}: {_last_line(message['log'])}"}
    return {"result": json.loads(text)}


# -- both ways -------------------------------------------------------------------------------------
def _run_target(target, request):
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)(request)


def _last_line(path):
    try:
        with open(path) as f:
            lines = f.read().strip().splitlines()
    except OSError:
        return "no output"
    return lines[-1] if lines else "no output"


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:  # call TARGET REQUEST
        print(_MARK + json.dumps(_run_target(sys.argv[2], json.loads(sys.argv[3]))), flush=True)
