"""NumPy fp64 reference of the layer metrics (algorithms.md section 3), for layer_metrics_test.

Reads DIR/z_orig.bin, DIR/z_aug.bin (fp64 [N, H]) and DIR/x.bin (fp64 [T, H]) with the shapes in
DIR/shapes.json; prints JSON {"infonce": ..., "spectral_entropy": ..., "effective_rank": ...}.
Written from the spec's formulas, independently of the C++ code.
"""
import json
import os
import sys

import numpy as np


def main():
    d = sys.argv[1]
    tau = float(sys.argv[2])
    shapes = json.load(open(os.path.join(d, "shapes.json")))
    zo = np.fromfile(os.path.join(d, "z_orig.bin"), dtype=np.float64).reshape(shapes["z"])
    za = np.fromfile(os.path.join(d, "z_aug.bin"), dtype=np.float64).reshape(shapes["z"])
    x = np.fromfile(os.path.join(d, "x.bin"), dtype=np.float64).reshape(shapes["x"])
    zo = zo / np.linalg.norm(zo, axis=1, keepdims=True)
    za = za / np.linalg.norm(za, axis=1, keepdims=True)
    n = zo.shape[0]
    losses = []
    for i in range(n):
        num = np.exp(np.dot(zo[i], za[i]) / tau)
        den = sum(np.exp(np.dot(zo[i], zo[j]) / tau) for j in range(n))
        losses.append(-np.log(num / den))
    xc = x - x.mean(axis=0, keepdims=True)
    s = np.linalg.svd(xc, compute_uv=False)
    s = s[s > 1e-12 * s.max()]
    p = s**2 / np.sum(s**2)
    q = s / np.sum(s)
    print(json.dumps({"infonce": float(np.mean(losses)),
                      "spectral_entropy": float(-np.sum(p * np.log(p))),
                      "effective_rank": float(np.exp(-np.sum(q * np.log(q))))}))


if __name__ == "__main__":
    main()
