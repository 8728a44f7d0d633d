#!/usr/bin/env python3
"""The repository explains itself: no tracked file points outside it (to the
shared folder beside a developer's checkout), and every relative link in
README.md and docs/*.md names a file or folder that exists.

Usage: check_docs.py SOURCE_DIR
"""
import os
import re
import subprocess
import sys

root = os.path.abspath(sys.argv[1])
outside = "../" + "shared"  # spelled in two parts so this file does not match itself
failures = []

files = subprocess.run(["git", "-C", root, "ls-files"], capture_output=True, text=True,
                       check=True).stdout.split()
if not files:
    sys.exit("check_docs: git lists no files under " + root)
for f in files:
    path = os.path.join(root, f)
    if not os.path.isfile(path):
        continue
    try:
        text = open(path, encoding="utf-8").read()
    except (UnicodeDecodeError, OSError):
        continue  # binary files (pictures)
    for n, line in enumerate(text.splitlines(), 1):
        if outside in line:
            failures.append(f"{f}:{n}: points outside the repository: {line.strip()}")

link = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path):
    """GitHub's heading anchors of a markdown file."""
    out = set()
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^#+\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


docs = ["README.md"] + sorted("docs/" + d for d in os.listdir(os.path.join(root, "docs"))
                              if d.endswith(".md"))
checked = 0
for doc in docs:
    text = open(os.path.join(root, doc), encoding="utf-8").read()
    for n, line in enumerate(text.splitlines(), 1):
        for target in link.findall(line):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # web addresses, mail, anchors in the same file
            relative, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(root, os.path.dirname(doc), relative))
            checked += 1
            if not resolved.startswith(root + os.sep) or not os.path.exists(resolved):
                failures.append(f"{doc}:{n}: link to {target} does not resolve inside the repository")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                failures.append(f"{doc}:{n}: {relative} has no heading #{anchor}")
if "docs/design.md" not in files:
    failures.append("docs/design.md is missing")
for f in failures:
    print("FAIL:", f)
if failures:
    sys.exit(1)
print(f"PASS: {len(files)} tracked files stay inside the repository; {checked} relative links "
      f"in {len(docs)} documents resolve")
