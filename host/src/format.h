// Numbers as Python prints them, so that the command's JSON reads like `specgraph generate --json`.
#pragma once

#include <string>

namespace sg {

// repr(float(x)): the shortest digits that read back as x; fixed notation for exponents in
// [-4, 16) with at least one digit after the point, else d.ddde+XX.
std::string py_float(double x);

// round(x, digits) as Python computes it (correctly rounded from x's exact binary value).
double py_round(double x, int digits);

}  // namespace sg
