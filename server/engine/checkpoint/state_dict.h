// A job's full state is a StateDict written as a safetensors file, both the
// codec's (codec/state_dict.h, codec/safetensors.h), so a checkpoint opens in
// PyTorch and ampctl reads what it exports without the engine. This header
// brings them into engine::checkpoint and names what a job writes. Naming
// (PyTorch's, so a state dict reads naturally next to torch's):
//   model.{i}.weight, model.{i}.bias            F32 master weights, layer i
//   transformer.wte.weight, transformer.h.{i}.attn.c_attn.weight, ...
//                                               a GPT's, Hugging Face GPT-2's
//                                               names (model/families/gpt2.cc)
//   optimizer.{param}.exp_avg / .exp_avg_sq     Adam/AdamW moments (F32)
//   optimizer.{param}.momentum_buffer           SGD momentum (F32)
// and metadata:
//   scaler.{key}      the scaler's state_dict, keys as the policy's own
//                     framework names them, values as decimal text (exact)
//   optimizer.step    optimizer updates applied so far
//   ampd.step         Step calls run so far (the job's sequence number)
//   ampd.*            other job bookkeeping, written by its owner
#pragma once

#include "codec/safetensors.h"
#include "codec/state_dict.h"
#include "server/engine/host_tensor.h"

namespace ampd::engine::checkpoint {

using codec::DecodeSafetensors;
using codec::DecodeSafetensorsMetadata;
using codec::EncodedSafetensors;
using codec::EncodeSafetensors;
using codec::EncodeSafetensorsHeader;
using codec::kMaxSafetensorsHeaderBytes;
using codec::NamedTensor;
using codec::StateDict;
using codec::ValidateStateDict;

}  // namespace ampd::engine::checkpoint
