#!/usr/bin/env python3
"""Every Python file of the tree passes pyflakes (ctest format_python_names):
no undefined name, which Python reports only when the line runs (an error
path a test never takes would raise NameError at a user instead of its
message), no import or variable left unused. A line that says `# noqa`
(an import made to test that a package is there) is left out, as flake8
leaves it.
    tests/format/check_python.py SOURCE_DIR"""
import os
import subprocess
import sys


def python_files(root):
    """The tracked .py files, and tracked scripts whose first line runs python."""
    listed = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout: every file under root but build folders
        names = [os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root)
                 for f in files if not os.path.relpath(d, root).startswith(("build", ".git"))]
    else:
        names = listed.stdout.split()
    found = []
    for name in names:
        path = os.path.join(root, name)
        if name.endswith(".py"):
            found.append(path)
        elif os.path.isfile(path) and os.access(path, os.X_OK):
            with open(path, "rb") as f:
                if b"python" in f.readline():
                    found.append(path)
    return sorted(found)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    try:
        import pyflakes  # noqa: F401
    except ImportError:
        print("format_python_names: no pyflakes (apt-get install python3-pyflakes)", file=sys.stderr)
        return 1
    files = python_files(root)
    run = subprocess.run([sys.executable, "-m", "pyflakes", *files], capture_output=True, text=True)
    problems = []
    for message in (run.stdout + run.stderr).splitlines():
        path, _, rest = message.partition(":")
        line = rest.split(":", 1)[0]
        if line.isdigit() and os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read().splitlines()
            if int(line) <= len(text) and "# noqa" in text[int(line) - 1]:
                continue
        problems.append(message)
    if problems:
        print(f"format_python_names: {len(problems)} problem(s) in {len(files)} Python files:",
              file=sys.stderr)
        for p in problems:
            print(f"  {os.path.relpath(p, root) if os.path.isabs(p) else p}", file=sys.stderr)
        return 1
    print(f"format_python_names: {len(files)} Python files, no undefined or unused name (pyflakes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
