"""Train a small fp16 job through ampd, then check its weights in PyTorch.

Usage: python3 quickstart.py HOST:PORT

The first steps overflow at the initial loss scale 2^20 and are skipped
while the scale backs off; then the scale grows every 5 clean steps. The
exported state dict loads into a PyTorch nn.Sequential whose loss on the
next batch is ampd's (to fp16's precision).
"""
import sys

import numpy as np
import torch

import ampd
import ampd.safetensors
import ampd.torch

client = ampd.Client(sys.argv[1])
model = ampd.Model([ampd.Linear(8, 32), ampd.ReLU(), ampd.Linear(32, 1)], loss="mse")
scaler = ampd.Scaler(policy="pytorch", init_scale=2.0**20, growth_interval=5)
job = client.create_job(model=model, precision="fp16", optimizer=ampd.AdamW(lr=1e-2),
                        scaler=scaler)

# 31 batches of 64 samples of a smooth target; the last one is held back.
rng = np.random.default_rng(0)
w = rng.standard_normal((8, 1)).astype(np.float32)
inputs = rng.standard_normal((31, 64, 8)).astype(np.float32)
batches = [(x, np.tanh(x @ w)) for x in inputs]

results = []
for x, y in batches[:30]:
    results.append(job.step(x, y))
skipped = sum(r.skipped for r in results)
scales = sorted({r.scale_after for r in results})
print("skipped", skipped, "scales", scales)

job.export("mlp.safetensors")
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
state = ampd.safetensors.load_file("mlp.safetensors")
net.load_state_dict(ampd.torch.to_state_dict(state))

x, y = batches[30]
torch_loss = torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y)).item()
ampd_loss = job.step(x, y).loss
print("torch", torch_loss, "ampd", ampd_loss)
