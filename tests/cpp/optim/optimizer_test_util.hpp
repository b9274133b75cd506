// A list of named parameters with deterministic values, for the optimizer unit tests.
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "megacore/core/tensor.hpp"
#include "megacore/layers/parameter.hpp"

namespace optim_test {

struct Model {
  std::vector<std::unique_ptr<megacore::layers::Parameter>> owned;
  std::vector<megacore::layers::Parameter*> params;
  /// A parameter of `dt` holding sin(0.37 k + offset) · 0.8 + 0.1 and a zero f32 main_grad.
  void add(const std::string& name, const megacore::Shape& shape, megacore::DType dt, double offset) {
    auto p = std::make_unique<megacore::layers::Parameter>();
    p->name = name;
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<float> v;
    for (int64_t k = 0; k < n; ++k) v.push_back(float(std::sin(0.37 * double(k) + offset) * 0.8 + 0.1));
    p->data = megacore::Tensor::from_vector(v, shape).to(dt);
    p->main_grad = megacore::Tensor::zeros(shape);
    params.push_back(p.get());
    owned.push_back(std::move(p));
  }
};

}  // namespace optim_test
