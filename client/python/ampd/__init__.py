"""ampd: a Python client for the ampd mixed-precision training service.

    import ampd
    client = ampd.Client("127.0.0.1:50051")
    job = client.create_job(model=ampd.Model([ampd.Linear(8, 32), ampd.ReLU(),
                                              ampd.Linear(32, 1)], loss="mse"),
                            precision="fp16", optimizer=ampd.AdamW(lr=3e-3))
    r = job.step(x, y)   # NumPy arrays or torch tensors
    print(r.loss, r.scale_before, r.scale_after, r.skipped)
    job.export("state.safetensors")

    # A GPT: (B, T) token ids in, (B, T) next-token targets (-100 ignored).
    gpt = client.create_job(model=ampd.GPT(vocab_size=50257, context_length=1024,
                                           d_model=768, n_layer=12, n_head=12),
                            precision="bf16", optimizer=ampd.AdamW(lr=6e-4))
    r = gpt.step(ids, targets)

    # One job across replicas, data-parallel: each step's rows split across them.
    dp = ampd.DataParallelJob.create(["ampd-0:50051", "ampd-1:50051"],
                                     rendezvous="ampd-0:50052", model=..., precision="fp16")
    r = dp.step(x, y)

    # A Hugging Face folder (GPT-2, Llama 2/3.x, Qwen2/2.5, Qwen3, Gemma 3), weights
    # and all: the server maps its config.json.
    job = client.create_job(model=ampd.from_pretrained("Llama-3.2-1B"), precision="bf16")
    job.save_pretrained("out")  # AutoModelForCausalLM.from_pretrained("out") opens it

The stubs (ampd.v1.trainer_pb2, trainer_pb2_grpc) are generated from
proto/ampd/v1/trainer.proto when the package is built.
"""
from ampd.client import (Client, Completion, EvaluateResult, ForwardBackwardResult, Job,
                         SamplerSnapshot, StepResult, Timings, to_tensor)
from ampd.data_parallel import DataParallelJob
from ampd.errors import (AccumulationLost, AccumulationPending, Aborted, AlreadyExists, AmpdError,
                         CreateRetry, DataLoss, DeadlineExceeded,
                         FailedPrecondition, Internal, InvalidArgument, InvalidField,
                         InvalidStateDict, JobFailed, JobLimit, JobNotFound, MemoryLimit,
                         NotFound, PermissionDenied, ResourceExhausted, ScalerAtMinScale,
                         SequenceMismatch, ServerDraining, SnapshotExists, SnapshotLimit,
                         SnapshotNotFound, StepResponseLost, StepsLost, Unauthenticated,
                         Unavailable)
from ampd.hf import from_hf_config, from_pretrained
from ampd.safetensors import StateDict
from ampd.spec import (GELU, GPT, SGD, Adam, AdamW, Decoder, Embedding, LayerNorm, Linear, LoRA,
                       Model, ReLU, RopeScaling, Scaler, Tanh)

__version__ = "0.1.0"

__all__ = [
    "Client", "Job", "DataParallelJob", "StepResult", "ForwardBackwardResult", "EvaluateResult",
    "Completion", "SamplerSnapshot", "Timings",
    "StateDict", "to_tensor",
    "from_pretrained", "from_hf_config", "RopeScaling",
    "Model", "GPT", "Decoder", "LoRA", "Linear", "ReLU", "GELU", "Tanh", "LayerNorm", "Embedding",
    "SGD", "Adam", "AdamW", "Scaler",
    "AmpdError", "InvalidArgument", "InvalidField", "InvalidStateDict", "NotFound",
    "JobNotFound", "FailedPrecondition", "SequenceMismatch", "StepsLost",
    "StepResponseLost", "JobFailed", "ScalerAtMinScale", "ResourceExhausted", "JobLimit",
    "MemoryLimit", "Aborted", "CreateRetry", "Unavailable", "ServerDraining",
    "DeadlineExceeded", "Unauthenticated", "PermissionDenied", "Internal", "DataLoss",
    "AccumulationLost", "AccumulationPending", "AlreadyExists", "SnapshotExists",
    "SnapshotLimit", "SnapshotNotFound",
]
