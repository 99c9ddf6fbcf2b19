#pragma once

// The Llama-3 model, split as torchtitan splits its models/llama3/:
//  - models/llama3/args.h: Llama3Args and torchtitan's flavors;
//  - models/llama3/model.h: the modules (no parallelism: [Note: models carry no parallelism]),
//    with models/llama3/rope.h (rotary embeddings, Llama 3.1's and YaRN's scaling) and
//    models/llama3/mla.h (DeepSeek-V3's multi-head latent attention);
//  - models/llama3/parallelize.h: apply_tp, apply_ac, parallelize_llama3, from outside;
//  - models/llama3/pipeline.h: the split into pipeline stages, parallelize_llama3_stage;
//  - models/llama3/generate.h: generation (with models/llama3/kv_cache.h), not included here;
//  - models/llama3/state_dict_adapter.h: Hugging Face names and layouts, export_hf / load_hf,
//    with models/llama3/hf_config.h (config.json written and read).
#include <models/llama3/args.h>
#include <models/llama3/model.h>
#include <models/llama3/parallelize.h>
#include <models/llama3/pipeline.h>
#include <models/llama3/state_dict_adapter.h>
