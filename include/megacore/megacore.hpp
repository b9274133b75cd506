// The whole public API of megacore in one include.
#pragma once

#include "megacore/build_config.hpp"
#include "megacore/core/allocator.hpp"
#include "megacore/core/device.hpp"
#include "megacore/core/dtype.hpp"
#include "megacore/core/error.hpp"
#include "megacore/core/random.hpp"
#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "megacore/comm/bootstrap.hpp"
#include "megacore/comm/communicator.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"
#include "megacore/comm/tcp_store.hpp"
#include "megacore/data/data.hpp"
