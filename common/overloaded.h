// Overloaded: one visitor from several lambdas, for std::visit over a
// variant (the model spec's kind), each alternative handled by its own.
#pragma once

namespace ampd {

template <class... Fs>
struct Overloaded : Fs... {
  using Fs::operator()...;
};
template <class... Fs>
Overloaded(Fs...) -> Overloaded<Fs...>;

}  // namespace ampd
