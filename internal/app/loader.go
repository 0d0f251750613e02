//go:build !hftokenizers

package app

import "github.com/kvbandit/kvbandit/tokenizer/models"

// nativeLoader is nil: the pure-Go tokenizer (build with -tags hftokenizers
// to load tokenizers through Hugging Face's native library).
var nativeLoader models.Loader
