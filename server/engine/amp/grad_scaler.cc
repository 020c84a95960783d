#include "server/engine/amp/grad_scaler.h"
