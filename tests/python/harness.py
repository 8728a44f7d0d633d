"""Shared by the Python tests: run this test file as N workers under
morse-run, and small helpers. Tests run with Debian's /usr/bin/python3 and
PYTHONPATH pointing at the built morse package (ctest sets it)."""
import os
import subprocess
import sys


def morse_run(script, workers, servers, *args, config=None, timeout=300):
    command = [os.environ["MORSE_RUN"], "--servers", str(servers), "--workers", str(workers)]
    if config:
        command += ["--config", config]
    command += ["--", sys.executable, script, "--worker", *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            timeout=timeout, text=True)
    return result.returncode, result.stdout


def check(condition, message):
    if not condition:
        print("FAIL:", message)
        sys.exit(1)
