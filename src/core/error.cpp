// The key functions of the exception classes: their vtables and type information are emitted here, once.
#include "kdakit/error.h"

namespace kdakit {

Error::~Error() = default;
InvalidArgument::~InvalidArgument() = default;
NotBuilt::~NotBuilt() = default;
CudaError::~CudaError() = default;

}  // namespace kdakit
