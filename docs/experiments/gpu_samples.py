"""nvidia-smi sampled in a background thread, for the experiments that time kernels under the power cap
(sustained_gemm.py, fa_vs_cudnn.py): ``samples = start(("clocks.sm", "power.draw"))`` returns a list that fills
with (time.time(), value, ...) tuples every ``ms`` milliseconds."""
import subprocess
import threading


def start(fields=("clocks.sm", "power.draw"), ms: int = 50) -> list:
    samples = []

    def run():
        p = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                              "-lms", str(ms)], stdout=subprocess.PIPE, text=True)
        import time
        for line in p.stdout:
            samples.append((time.time(), *(float(x) for x in line.strip().split(", "))))

    threading.Thread(target=run, daemon=True).start()
    return samples
