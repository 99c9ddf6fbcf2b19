#pragma once

// What every multi-rank test program starts with: Catch2, the rank / device helpers, the
// DTensor helpers, and the names the tests use most, brought into scope once.
#include "support/catch.h"
#include "support/dist.h"
#include "support/pieces.h"

using dtensor::CollectiveKind;
using dtensor::CommDebugMode;
using dtensor::DeviceMesh;
using dtensor::DTensor;
using dtensor::FullyShardOptions;
using dtensor::init_device_mesh;
using dtensor::Placement;
using dtensor::Placements;
using dtensor::ReduceOp;
using dtensor::testing::close;
using dtensor::testing::contains;
using dtensor::testing::device_type;
using dtensor::testing::full_value;
using dtensor::testing::options;
using dtensor::testing::rank;
using dtensor::testing::same;
using dtensor::testing::world;
using dtensor::testing::over;
