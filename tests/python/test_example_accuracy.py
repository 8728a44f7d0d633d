"""The example: morse.torch.OneBitAdam trains the digits MLP to within 1
point of torch.optim.Adam's test accuracy (4 workers, 2 servers)."""
import json
import os
import sys

from harness import check, morse_run

if __name__ == "__main__":
    example = os.path.join(os.path.dirname(__file__), "..", "..", "worker", "python", "examples",
                           "digits_mlp.py")
    import subprocess
    result = subprocess.run([os.environ["MORSE_RUN"], "--servers", "2", "--workers", "4", "--",
                             sys.executable, example], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=600)
    print(result.stdout[-3000:])
    check(result.returncode == 0, "the example failed")
    line = [l for l in result.stdout.splitlines() if l.startswith("[rank 0] {")][-1]
    r = json.loads(line[len("[rank 0] "):])
    print(f"onebit_adam {r['test_accuracy']:.4f}, torch.optim.Adam {r['torch_adam_test_accuracy']:.4f}")
    check(r["test_accuracy"] >= r["torch_adam_test_accuracy"] - 0.01, "more than a point below Adam")
    check(r["push_bytes_last_step"] * 25 < r["fp32_bytes_per_step"], "1-bit steps are not ~32x smaller")
    print("PASS")
