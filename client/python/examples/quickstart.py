import sys, numpy as np, torch, ampd, ampd.torch  # usage: quickstart.py HOST:PORT
job = ampd.Client(sys.argv[1]).create_job(
    model=ampd.Model([ampd.Linear(8, 32), ampd.ReLU(), ampd.Linear(32, 1)], loss="mse"), precision="fp16",
    optimizer=ampd.AdamW(lr=1e-2), scaler=ampd.Scaler(policy="pytorch", init_scale=2.0**20, growth_interval=5))
rng = np.random.default_rng(0); w = rng.standard_normal((8, 1)).astype(np.float32)
batches = [(x, np.tanh(x @ w)) for x in rng.standard_normal((31, 64, 8)).astype(np.float32)]
results = [job.step(x, y) for x, y in batches[:30]]
print("skipped", sum(r.skipped for r in results), "scales", sorted({r.scale_after for r in results}))
job.export("mlp.safetensors")
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
net.load_state_dict(ampd.torch.to_state_dict(ampd.safetensors.load_file("mlp.safetensors")))
x, y = map(torch.from_numpy, batches[30])
print("torch", torch.nn.functional.mse_loss(net(x), y).item(), "ampd", job.step(*batches[30]).loss)
