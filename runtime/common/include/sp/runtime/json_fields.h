// Typed access to user-written JSON whose errors name the place, the field and the
// expectation (sp/input_files/json_fields.h, shared with the adapters), under the runtime's names.
#pragma once

#include "sp/input_files/json_fields.h"

namespace sp::runtime {

using input_files::JsonFieldError;
using input_files::JsonFields;

}  // namespace sp::runtime
