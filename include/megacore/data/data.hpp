// The data pipeline: indexed datasets, GPT samples, blends and splits, SFT packing, the loader, and the
// built-in tokenizer and corpus.
#pragma once

#include "megacore/data/blended_dataset.hpp"
#include "megacore/data/corpus.hpp"
#include "megacore/data/gpt_dataset.hpp"
#include "megacore/data/indexed_dataset.hpp"
#include "megacore/data/loader.hpp"
#include "megacore/data/packing.hpp"
#include "megacore/data/sample_source.hpp"
