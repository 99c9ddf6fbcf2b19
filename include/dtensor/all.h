#pragma once

// Everything public in dtensor.
#include <dtensor/collectives.h>
#include <dtensor/comm_debug_mode.h>
#include <dtensor/device_mesh.h>
#include <dtensor/dtensor.h>
#include <dtensor/dtensor_spec.h>
#include <dtensor/error.h>
#include <dtensor/factories.h>
#include <dtensor/placement.h>
#include <dtensor/process_group.h>
#include <dtensor/random.h>
#include <dtensor/comm_hooks.h>
#include <dtensor/replicate.h>
#include <dtensor/fully_shard.h>
#include <dtensor/grad_hooks.h>
#include <dtensor/materialize.h>
#include <dtensor/state_dict.h>
#include <dtensor/tensor_parallel.h>
#include <dtensor/clip_grad.h>
#include <dtensor/grad_scaler.h>
#include <dtensor/activation_checkpoint.h>
#include <dtensor/user_rules.h>
#include <dtensor/register_sharding.h>
#include <dtensor/simulate.h>
