// Whole-file reads for the reference host tools' inputs: sp/input_files/read_file.h (shared with
// the adapters) under the runtime's names.
#pragma once

#include "sp/input_files/read_file.h"

namespace sp::runtime {

using input_files::FileReadError;
using input_files::open_input_file;
using input_files::read_whole_file;

}  // namespace sp::runtime
