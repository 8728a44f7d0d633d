#!/usr/bin/env python3
"""Checks design.md 5's dependency rules against the includes in the tree.

Usage: check_layers.py REPO_ROOT

1. Each folder includes only what the table of design.md 5 allows: of the
   project's own folders and of the libraries spelled with a folder
   ("absl/...", "grpcpp/...").
2. Inside each folder no files include each other in a loop. A file and
   its header count as one unit (compress/replica.cc and compress/replica.h),
   so a header that includes a higher file through its .cc's partner is a
   loop too. The loops that are the design's own are listed in
   KNOWN_LOOPS with why; a new one fails the check, naming its files.

Exits 1 and prints each breach; prints a one-line summary when the tree
holds to the rules.
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCES = (".cc", ".h", ".cu", ".cuh", ".inc")

# design.md 5, "may include": the project's folders and the libraries each
# folder's code may name. A folder's own files are always allowed.
ALLOWED = {
    "compress": {"absl"},
    "kernels": {"compress", "absl"},
    "proto": {"compress", "absl", "google", "grpcpp", "grpc", "boost", "prometheus"},
    "server": {"proto", "compress", "absl", "google", "grpcpp", "grpc", "boost", "prometheus"},
    "worker": {"proto", "compress", "kernels", "absl", "google", "grpcpp", "grpc", "boost",
               "prometheus"},
}
# Narrower rules inside a folder: (folder, included folder) -> the only
# subfolder of it whose files may include that folder.
ONLY_FROM = {("worker", "kernels"): "worker/engine/cuda/"}

# The loops the design has. compress/: codec.cc dispatches each CodecKind
# to its part (codec_parts.h, which takes codec.h's types), and its loops
# run through the SIMD element operations (simd/element_ops.h) into the
# kernel tables (kernels.h), whose declarations take codec.h's types.
# server/: ShardCore's private PartitionState is defined in an internal
# header of its own (partition_state.h), which shard_core.cc and
# shard_checkpoint.cc include. worker/engine/: engine.cc's factory picks
# the host or the CUDA engine at run time, and both implement engine.h.
KNOWN_LOOPS = [
    {"compress/codec", "compress/codec_parts", "compress/kernels", "compress/simd/element_ops"},
    {"server/shard_core", "server/partition_state"},
    {"worker/engine/engine", "worker/engine/host/engine", "worker/engine/cuda/engine"},
]


def sources(root, folder):
    for base, dirs, files in os.walk(os.path.join(root, folder)):
        dirs[:] = [d for d in dirs if d not in ("build", "__pycache__")]
        for name in files:
            if name.endswith(SOURCES):
                path = os.path.join(base, name)
                yield os.path.relpath(path, root), open(path, encoding="utf-8").read()


def folder_rules(root):
    breaches = []
    for folder, allowed in ALLOWED.items():
        for path, text in sources(root, folder):
            for target in INCLUDE.findall(text):
                if "/" not in target:
                    continue  # a generated header beside its source, or a system one
                top = target.split("/", 1)[0]
                if top == folder:
                    continue
                if top not in allowed:
                    breaches.append(f"{path} includes {target}: {folder}/ may include "
                                    f"{', '.join(sorted(allowed))} (design.md 5)")
                elif (folder, top) in ONLY_FROM and not path.startswith(ONLY_FROM[folder, top]):
                    breaches.append(f"{path} includes {target}: only "
                                    f"{ONLY_FROM[folder, top]} may include {top}/ (design.md 5)")
    return breaches


def unit(path):
    return os.path.splitext(path)[0]


def loops(graph):
    """The strongly connected components of more than one unit (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def folder_loops(root, folder):
    graph, files = {}, {}
    for path, text in sources(root, folder):
        files.setdefault(unit(path), []).append(path)
        for target in INCLUDE.findall(text):
            if target.startswith(folder + "/") and unit(target) != unit(path):
                graph.setdefault(unit(path), set()).add(unit(target))
    breaches = []
    for component in loops(graph):
        if component in KNOWN_LOOPS:
            continue
        edges = sorted(f"{a} -> {b}" for a in component for b in graph.get(a, ())
                       if b in component)
        breaches.append(f"{folder}/ files include each other in a loop (a file and its "
                        "header are one unit): " + "; ".join(edges) +
                        ". Move what the lower file needs into a header of its own "
                        "(as compress/step_rules.h holds the step's rules as data).")
    return breaches, len(files)


def main():
    root = os.path.abspath(sys.argv[1])
    breaches, units = folder_rules(root), 0
    for folder in ALLOWED:
        found, count = folder_loops(root, folder)
        breaches += found
        units += count
    for b in breaches:
        print(b)
    if breaches:
        return 1
    print(f"design.md 5 holds: {', '.join(ALLOWED)} include only what they may; "
          f"their {units} units without loops but the {len(KNOWN_LOOPS)} known")
    return 0


if __name__ == "__main__":
    sys.exit(main())
