"""Routes as data (``Route``, ``record_launches``, ``launch``, ``launched``) live in ``_common``;
this module is the same object under its first name."""

import sys

from . import _common as _module

sys.modules[__name__] = _module
