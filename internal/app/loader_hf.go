//go:build hftokenizers

package app

import (
	"os"
	"path/filepath"

	"github.com/kvbandit/kvbandit/tokenizer"
	"github.com/kvbandit/kvbandit/tokenizer/chat"
	"github.com/kvbandit/kvbandit/tokenizer/hf"
	"github.com/kvbandit/kvbandit/tokenizer/models"
)

// nativeLoader loads tokenizer.json with Hugging Face's native library; the
// chat template and special tokens still come from tokenizer_config.json.
var nativeLoader models.Loader = func(path string) (tokenizer.Tokenizer, tokenizer.Config, error) {
	file, cfgPath := path, ""
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		file = filepath.Join(path, "tokenizer.json")
		cfgPath = filepath.Join(path, "tokenizer_config.json")
	}
	tk, err := hf.Load(file)
	if err != nil {
		return nil, tokenizer.Config{}, err
	}
	var cfg tokenizer.Config
	if cfgPath != "" {
		if raw, err := os.ReadFile(cfgPath); err == nil {
			if t, sp, err := chat.FromTokenizerConfig(raw); err == nil {
				cfg = tokenizer.Config{BOSToken: sp.BOSToken, EOSToken: sp.EOSToken}
				if t != nil {
					cfg.ChatTemplate = t.Source()
				}
			}
		}
	}
	return tk, cfg, nil
}
